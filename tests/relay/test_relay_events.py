"""Datagrams and malformed tracks through the relay's real event path (d16 §2.4.2, §10.3.1, relay
rules), with real QUIC peers on 127.0.0.1.

A publisher that sends OBJECT_DATAGRAMs has them forwarded to subscribers as datagrams and
cached (a FETCH after it left gets them). A publisher whose object breaks the extension rules
(two IMMUTABLE_EXTENSIONS: the session's parser finds the track malformed) gets STOP_SENDING
MALFORMED_TRACK and UNSUBSCRIBE / FETCH_CANCEL; subscribers get their stream reset and
PUBLISH_DONE with MALFORMED_TRACK; the track is tombstoned; every session stays up.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from moqt.asyncio import MOQTConnection, RequestRejected, connect
from moqt.backend import TransportConfig, get_backend
from moqt.certs import make_self_signed
from moqt.errors import PublishDoneCode, RequestErrorCode, StreamResetCode
from moqt.messages_params import ExtensionType
from moqt.session_events import (
    DatagramReceived,
    DataStreamFinished,
    DataStreamReset,
    FetchCancelReceived,
    FetchReceived,
    MOQTEvent,
    ObjectData,
    PublishDoneReceived,
    SubscribeReceived,
    UnsubscribeReceived,
)
from moqt.wire import Location
from tests.support.backends import BACKENDS
from tests.support.polling import until
from tests.support.relay_kit import (
    Certs,
    block_track,
    client,
    fetch_all,
    make_block,
    port_of,
    publishing,
    relay_config,
    run,
    running_relay,
)

pytestmark = pytest.mark.timeout(60)
NAMESPACE = (b"plain", b"events")
PAYLOADS = [bytes([65 + i]) * (200 + i) for i in range(4)]
GOOD = b"G" * 3000
BAD_EXTENSIONS = [  # §11.2: at most one IMMUTABLE_EXTENSIONS per object
    (ExtensionType.IMMUTABLE_EXTENSIONS, b""),
    (ExtensionType.IMMUTABLE_EXTENSIONS, b""),
]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("relay-certs"))


def stop_sending_codes(connection: MOQTConnection) -> list[int]:
    """The error codes of the STOP_SENDING frames this peer's QUIC connection receives from
    now on (the session handles them too, after the UNSUBSCRIBE that may have come first)."""
    codes: list[int] = []
    protocol: Any = connection._protocol
    inner = protocol.quic_event_received

    def spy(event: Any) -> None:
        if type(event).__name__ == "StopSendingReceived":
            codes.append(int(event.error_code))
        inner(event)

    protocol.quic_event_received = spy
    return codes


async def next_of(connection: MOQTConnection, kind: type) -> MOQTEvent:
    """The next request or notice of ``kind`` the peer sent (others are skipped)."""
    while True:
        event = await connection.next_request()
        assert event is not None, "the session closed"
        if isinstance(event, kind):
            return event


async def send_datagrams(publisher: MOQTConnection) -> None:
    event = await next_of(publisher, SubscribeReceived)
    rid = event.request_id
    publisher.session.subscribe_ok(rid)
    publisher.transmit()
    for index, payload in enumerate(PAYLOADS):
        last = index == len(PAYLOADS) - 1
        publisher.session.send_datagram(rid, 0, index, payload, end_of_group=last)
        publisher.transmit()
        await asyncio.sleep(0.01)  # datagrams carry no delivery promise: do not burst
    publisher.session.publish_done(rid, PublishDoneCode.TRACK_ENDED, stream_count=0)
    publisher.transmit()


@pytest.mark.parametrize("backend", BACKENDS)
def test_datagrams_are_forwarded_as_datagrams_and_cached(backend: str, certs: Certs) -> None:
    track = (NAMESPACE, b"datagrams")

    async def scenario() -> None:
        async with running_relay(relay_config(certs, backend=backend)) as relay:
            async with (
                client(relay.url, certs, backend=backend) as pub,
                client(relay.url, certs, backend=backend) as sub,
            ):
                await pub.publish_namespace(NAMESPACE)
                sender = asyncio.create_task(send_datagrams(pub))
                subscription = await sub.subscribe(*track)
                events = [e async for e in subscription.track.events()]
                await sender
                received = [e.datagram for e in events if isinstance(e, DatagramReceived)]
                assert [(d.group_id, d.object_id, bytes(d.payload)) for d in received] == [
                    (0, i, p) for i, p in enumerate(PAYLOADS)
                ]
                assert received[-1].end_of_group
                done = [e for e in events if isinstance(e, PublishDoneReceived)]
                assert done[0].message.status_code == PublishDoneCode.TRACK_ENDED
            async with client(relay.url, certs, backend=backend) as late:  # the publisher has gone
                objects = await fetch_all(late, track, len(PAYLOADS))
                assert [bytes(o.payload) for o in objects] == PAYLOADS

    run(scenario())


async def send_malformed_subgroup(publisher: MOQTConnection) -> None:
    event = await next_of(publisher, SubscribeReceived)
    rid = event.request_id
    publisher.session.subscribe_ok(rid)
    stream = await publisher.open_subgroup(rid, 0)
    await publisher.send_object(stream, 0, GOOD)
    await publisher.send_object(stream, 1, b"bad", extensions=BAD_EXTENSIONS)
    await next_of(publisher, UnsubscribeReceived)


def test_a_malformed_subscription_is_reset_and_tombstoned(certs: Certs) -> None:
    track = (NAMESPACE, b"malformed-subscription")

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs)) as relay,
            client(relay.url, certs) as pub,
            client(relay.url, certs) as sub,
        ):
            await pub.publish_namespace(NAMESPACE)
            stopped = stop_sending_codes(pub)
            sender = asyncio.create_task(send_malformed_subgroup(pub))
            subscription = await sub.subscribe(*track)
            events = [e async for e in subscription.track.events()]
            await asyncio.wait_for(sender, 10)  # upstream: UNSUBSCRIBE ...
            await until(lambda: bool(stopped))  # ... and STOP_SENDING MALFORMED_TRACK
            assert stopped == [StreamResetCode.MALFORMED_TRACK]
            data = b"".join(bytes(e.data) for e in events if isinstance(e, ObjectData))
            assert b"bad" not in data and set(data) <= set(GOOD)
            resets = [e.error_code for e in events if isinstance(e, DataStreamReset)]
            assert resets == [StreamResetCode.MALFORMED_TRACK]
            done = [e for e in events if isinstance(e, PublishDoneReceived)]
            assert [d.message.status_code for d in done] == [PublishDoneCode.MALFORMED_TRACK]
            with pytest.raises(RequestRejected) as info:  # tombstoned
                await sub.subscribe(*track)
            assert info.value.error_code == RequestErrorCode.MALFORMED_TRACK
            with pytest.raises(RequestRejected) as info:
                await fetch_all(sub, track, 2)
            assert info.value.error_code == RequestErrorCode.MALFORMED_TRACK
            # a malformed track is not a protocol violation: both sessions are up
            assert pub.session.closed is None and sub.session.closed is None
            assert track not in relay.tracks

    run(scenario())


async def answer_fetch_malformed(publisher: MOQTConnection) -> None:
    event = await next_of(publisher, FetchReceived)
    rid = event.request_id
    publisher.session.fetch_ok(rid, end_location=Location(0, 1), end_of_track=True)
    stream = await publisher.open_fetch_stream(rid)
    await publisher.send_fetch_object(stream, group_id=0, object_id=0, payload=GOOD)
    await publisher.send_fetch_object(
        stream, group_id=0, object_id=1, payload=b"bad", extensions=BAD_EXTENSIONS
    )
    await next_of(publisher, FetchCancelReceived)


def test_a_malformed_fetch_passed_upstream_is_reset_and_tombstoned(certs: Certs) -> None:
    track = (NAMESPACE, b"malformed-fetch")

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs)) as relay,
            client(relay.url, certs) as pub,
            client(relay.url, certs) as sub,
        ):
            await pub.publish_namespace(NAMESPACE)
            stopped = stop_sending_codes(pub)
            sender = asyncio.create_task(answer_fetch_malformed(pub))
            response = await sub.fetch(*track, Location(0, 0), Location(0, 2))
            events = [e async for e in response.track.events()]
            await asyncio.wait_for(sender, 10)  # upstream: FETCH_CANCEL ...
            await until(lambda: bool(stopped))  # ... and STOP_SENDING MALFORMED_TRACK
            assert stopped == [StreamResetCode.MALFORMED_TRACK]
            resets = [e.error_code for e in events if isinstance(e, DataStreamReset)]
            assert resets == [StreamResetCode.MALFORMED_TRACK]
            await until(lambda: relay.cache.is_malformed(track, relay.clock.now_ms()))
            with pytest.raises(RequestRejected) as info:
                await fetch_all(sub, track, 2)
            assert info.value.error_code == RequestErrorCode.MALFORMED_TRACK
            assert pub.session.closed is None and sub.session.closed is None

    run(scenario())


def test_publish_done_follows_the_tail_of_the_last_object(certs: Certs) -> None:
    """PUBLISH_DONE leaves once the subscriber's stream drained, so it never overtakes the
    tail of the last object (peers such as moq-rs end the track on PUBLISH_DONE)."""
    block = make_block(70, layers=4, size=512 << 10)

    # a subscriber with small windows: the relay still holds most of the block when the
    # track ends upstream
    small = TransportConfig(max_stream_data=64 << 10, max_data=128 << 10)
    configuration = get_backend("aioquic").configuration(
        is_client=True, transport=small, cafile=str(certs[0]), server_name="localhost"
    )

    async def scenario() -> None:
        async with (
            running_relay(relay_config(certs)) as relay,
            publishing(relay.url, certs, block_track(block), [block.namespace]) as pub,
            connect(
                "127.0.0.1", port_of(relay.url), configuration=configuration, transport=small
            ) as sub,
        ):
            subscription = await sub.subscribe(*block.track)
            pub.release.set()
            kinds = [type(e) async for e in subscription.track.events()]
            assert kinds.index(PublishDoneReceived) > kinds.index(DataStreamFinished)
            assert kinds.count(ObjectData) > 4  # the objects came in many pieces

    run(scenario())
