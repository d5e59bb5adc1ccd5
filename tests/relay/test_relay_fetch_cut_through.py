"""A FETCH the cache misses, passed upstream and forwarded cut-through (relay/fetch.py), over real
QUIC and over QMux on plain TCP on 127.0.0.1 (publisher and subscriber on the same carrier): each
object goes on downstream as its bytes arrive, and is cached once whole.

What must hold whatever the upstream does: an object reaches the subscriber whole before the
stream's FIN, or the stream is reset (never a truncated object passed as whole); an upstream
reset is passed on with its code; a layer that fails its in-band digest (DESIGN §4) resets the
stream with MALFORMED_TRACK and tombstones the track before the FIN could go out; the cache
holds exactly the objects that arrived whole, byte for byte, with their layer digests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest

from moqt.asyncio import MOQTConnection, RequestRejected, connect
from moqt.backend import TransportConfig, get_backend
from moqt.certs import make_self_signed
from moqt.errors import RequestErrorCode, StreamResetCode
from moqt.qmux_asyncio import QMuxEndpoint, connect_qmux
from moqt.qmux_config import QMuxConfig
from moqt.session_events import (
    DataStreamFinished,
    DataStreamReset,
    FetchReceived,
    MOQTEvent,
    ObjectData,
    ObjectHeader,
)
from moqt.wire import Location
from relay.cache import TrackKey
from relay.relay import Relay
from tests.support.polling import until
from tests.support.relay_kit import (
    Block,
    Certs,
    Publisher,
    Track,
    block_track,
    fetch_all,
    make_block,
    port_of,
    relay_config,
    run,
    running_relay,
)

pytestmark = pytest.mark.timeout(60)
LAYER = 96 << 10  # many packets or QMux frames, several receive batches per object
UPSTREAM_RESET = 0x7  # an application code the relay has no meaning for: passed on as is
SMALL_WINDOWS = {"max_stream_data": 32 << 10, "max_data": 64 << 10}
CARRIERS = ["quic", "qmux-tcp"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_self_signed("localhost", tmp_path_factory.mktemp("relay-certs"))


@contextlib.asynccontextmanager
async def relay_on(certs: Certs, carrier: str) -> AsyncIterator[Relay]:
    """An open relay that also listens for QMux over plain TCP when ``carrier`` asks for it."""
    extra = {"qmux_tcp": ("127.0.0.1", 0)} if carrier == "qmux-tcp" else {}
    async with running_relay(relay_config(certs, **extra)) as relay:
        yield relay


@contextlib.asynccontextmanager
async def session(
    relay: Relay, certs: Certs, carrier: str, *, small: bool = False
) -> AsyncIterator[MOQTConnection]:
    """A MOQT session to ``relay`` over ``carrier``; ``small``: with small flow-control
    windows (a subscriber the relay must wait for)."""
    if carrier == "quic":
        transport = TransportConfig(**SMALL_WINDOWS) if small else TransportConfig()
        configuration = get_backend("aioquic").configuration(
            is_client=True, transport=transport, cafile=str(certs[0]), server_name="localhost"
        )
        async with connect(
            "127.0.0.1", port_of(relay.url), configuration=configuration, transport=transport
        ) as connection:
            yield connection
        return
    uri = next(uri for uri in relay.carriers if uri.startswith("moqt+tcp://"))
    endpoint = QMuxEndpoint(carrier="tcp", host="127.0.0.1", port=urlsplit(uri).port)
    qmux = QMuxConfig(**SMALL_WINDOWS) if small else None
    async with connect_qmux(endpoint, qmux=qmux) as connection:
        yield connection


@contextlib.asynccontextmanager
async def publishing_on(
    relay: Relay, certs: Certs, carrier: str, tracks: dict[TrackKey, Track], block: Block
) -> AsyncIterator[Publisher]:
    """The scripted publisher of ``tracks`` over ``carrier``, ``block``'s namespace announced."""
    async with session(relay, certs, carrier) as connection:
        publisher = Publisher(connection, tracks)
        runner = asyncio.create_task(publisher.run())
        try:
            await publisher.announce(block.namespace)
            yield publisher
        finally:
            runner.cancel()
            for task in list(publisher.tasks):
                task.cancel()


def assert_cached_exactly(relay: Relay, block: Block, count: int) -> None:
    """Objects 0..count-1 of ``block`` are cached byte for byte with their layer digests, and
    nothing beyond them."""
    now = relay.clock.now_ms()
    for index in range(len(block.layers)):
        cached = relay.cache.get(block.track, Location(0, index), now)
        if index >= count:
            assert cached is None, f"object {index} is cached but never arrived whole"
            continue
        assert cached is not None, f"object {index} is not cached"
        assert bytes(cached.payload_bytes()) == block.layers[index]
        assert cached.digest == block.digests[index]


async def next_fetch(publisher: MOQTConnection) -> FetchReceived:
    while True:
        event = await publisher.next_request()
        assert event is not None, "the session closed"
        if isinstance(event, FetchReceived):
            return event


async def answer_in_part(publisher: MOQTConnection, block: Block, whole: int, part: int) -> int:
    """Answer the next FETCH with objects 0..whole-1 of ``block``, then ``part`` octets of
    object ``whole``; returns the fetch stream (still open)."""
    event = await next_fetch(publisher)
    session = publisher.session
    last = len(block.layers) - 1
    session.fetch_ok(event.request_id, end_location=Location(0, last), end_of_track=True)
    stream = await publisher.open_fetch_stream(event.request_id)
    objects = block.objects()
    for index in range(whole):
        payload, extensions = objects[index]
        await publisher.send_fetch_object(
            stream, group_id=0, object_id=index, payload=payload, extensions=extensions
        )
    payload, extensions = objects[whole]
    session.begin_fetch_object(
        stream, group_id=0, object_id=whole, payload_length=len(payload), extensions=extensions
    )
    await publisher.write_payload(stream, payload[:part])
    publisher.transmit()
    return stream


async def read_events(
    connection: MOQTConnection, block: Block, count: int, into: list[MOQTEvent] | None = None
) -> list[MOQTEvent]:
    """FETCH objects 0..count-1 of ``block`` and return every event of the response; ``into``
    receives them as they arrive, for a test that acts once the subscriber has seen enough."""
    events = [] if into is None else into
    response = await connection.fetch(*block.track, Location(0, 0), Location(0, count))
    async for event in response.track.events():
        events.append(event)
    return events


def seen_whole(events: list[MOQTEvent], block: Block, count: int) -> bool:
    """Whether the subscriber has seen objects 0..count-1 of ``block`` whole so far."""
    seen = payloads(events)
    return all(seen.get(index) == block.layers[index] for index in range(count))


def payloads(events: list[MOQTEvent]) -> dict[int, bytes]:
    """Object ID → the payload octets the subscriber saw of it (whole or not)."""
    seen: dict[int, bytearray] = {}
    current = -1
    for event in events:
        if isinstance(event, ObjectHeader):
            current = event.object.object_id
            seen[current] = bytearray()
        elif isinstance(event, ObjectData):
            seen[current] += event.data
    return {object_id: bytes(data) for object_id, data in seen.items()}


@pytest.mark.parametrize("carrier", CARRIERS)
def test_an_upstream_reset_mid_object_is_passed_on_and_the_part_is_not_cached(
    certs: Certs, carrier: str
) -> None:
    block = make_block(301, layers=3, size=LAYER)

    async def scenario() -> None:
        async with (
            relay_on(certs, carrier) as relay,
            session(relay, certs, carrier) as pub,
            session(relay, certs, carrier) as sub,
        ):
            await pub.publish_namespace(block.namespace)
            answering = asyncio.create_task(answer_in_part(pub, block, 1, LAYER // 3))
            arrived: list[MOQTEvent] = []
            reading = asyncio.create_task(read_events(sub, block, 3, arrived))
            stream = await answering
            # object 0 went on whole before the upstream's reset (a reset may discard what the
            # relay had queued but not yet sent, so the test waits for the subscriber's copy)
            await until(
                lambda: len(relay_objects(relay, block)) >= 1 and seen_whole(arrived, block, 1)
            )
            pub.session.reset_data_stream(stream, UPSTREAM_RESET)
            pub.transmit()
            events = await reading
            seen = payloads(events)
            assert seen[0] == block.layers[0]  # the whole object went on at once
            assert block.layers[1].startswith(seen.get(1, b""))  # only a part of object 1 ...
            assert len(seen.get(1, b"")) < LAYER
            assert not any(isinstance(e, DataStreamFinished) for e in events)  # ... never whole
            resets = [e.error_code for e in events if isinstance(e, DataStreamReset)]
            assert resets == [UPSTREAM_RESET]
            assert_cached_exactly(relay, block, 1)
            assert not relay.cache.is_malformed(block.track, relay.clock.now_ms())

    run(scenario())


def relay_objects(relay: Relay, block: Block) -> list[bytes]:
    """The payloads the relay holds of ``block`` so far."""
    entry = relay.cache.track(block.track)
    if entry is None:
        return []
    return [bytes(obj.payload_bytes()) for obj in entry.objects.values()]


@pytest.mark.parametrize("carrier", CARRIERS)
def test_an_upstream_session_lost_mid_object_resets_the_downstream_stream(
    certs: Certs, carrier: str
) -> None:
    block = make_block(302, layers=3, size=LAYER)

    async def scenario() -> None:
        async with relay_on(certs, carrier) as relay, session(relay, certs, carrier) as sub:
            async with session(relay, certs, carrier) as pub:
                await pub.publish_namespace(block.namespace)
                answering = asyncio.create_task(answer_in_part(pub, block, 2, LAYER // 2))
                arrived: list[MOQTEvent] = []
                reading = asyncio.create_task(read_events(sub, block, 3, arrived))
                await answering
                await until(
                    lambda: len(relay_objects(relay, block)) >= 2 and seen_whole(arrived, block, 2)
                )
            # the publisher's session is gone with object 2 half sent
            events = await reading
            seen = payloads(events)
            assert [seen[0], seen[1]] == list(block.layers[:2])
            assert len(seen.get(2, b"")) < LAYER
            assert not any(isinstance(e, DataStreamFinished) for e in events)
            assert any(isinstance(e, DataStreamReset) for e in events)
            assert_cached_exactly(relay, block, 2)
            # the rest is a miss again, and with no source left the FETCH is refused
            with pytest.raises(RequestRejected) as info:
                await fetch_all(sub, block.track, 3)
            assert info.value.error_code == RequestErrorCode.DOES_NOT_EXIST
            assert sub.session.closed is None

    run(scenario())


@pytest.mark.parametrize("carrier", CARRIERS)
def test_a_layer_failing_its_digest_resets_the_stream_before_its_fin(
    certs: Certs, carrier: str
) -> None:
    block = make_block(303, layers=4, size=LAYER)
    forged = bytearray(block.layers[2])
    forged[LAYER // 2] ^= 0xFF  # one octet off, the digest extension of the real layer
    objects = block.objects()
    objects[2] = (bytes(forged), objects[2][1])

    async def scenario() -> None:
        tracks = block_track(block)
        tracks[block.track].objects = objects
        async with (
            relay_on(certs, carrier) as relay,
            publishing_on(relay, certs, carrier, tracks, block),
            session(relay, certs, carrier) as sub,
        ):
            events = await read_events(sub, block, 4)
            assert not any(isinstance(e, DataStreamFinished) for e in events)
            resets = [e.error_code for e in events if isinstance(e, DataStreamReset)]
            assert resets == [StreamResetCode.MALFORMED_TRACK]
            assert relay.cache.is_malformed(block.track, relay.clock.now_ms())
            assert relay.cache.track(block.track) is None  # nothing of it stays cached
            with pytest.raises(RequestRejected) as info:
                await fetch_all(sub, block.track, 4)
            assert info.value.error_code == RequestErrorCode.MALFORMED_TRACK

    run(scenario())


@pytest.mark.parametrize("carrier", CARRIERS)
def test_a_slow_downstream_gets_every_byte_and_the_cache_the_whole_block(
    certs: Certs, carrier: str
) -> None:
    """A subscriber whose flow-control windows are far smaller than the block: the relay
    queues what it cannot send yet (the received pieces themselves) and forwards all of it."""
    block = make_block(304, layers=6, size=256 << 10)

    async def scenario() -> None:
        async with (
            relay_on(certs, carrier) as relay,
            publishing_on(relay, certs, carrier, block_track(block), block) as pub,
            session(relay, certs, carrier, small=True) as slow,
        ):
            objects = await fetch_all(slow, block.track, len(block.layers))
            assert [bytes(obj.payload) for obj in objects] == list(block.layers)
            assert pub.fetches == 1
            assert_cached_exactly(relay, block, len(block.layers))
            async with session(relay, certs, carrier) as fast:  # now a hit
                again = await fetch_all(fast, block.track, len(block.layers))
            assert [bytes(obj.payload) for obj in again] == list(block.layers)
            assert pub.fetches == 1

    run(scenario())


@pytest.mark.parametrize("carrier", CARRIERS)
def test_two_downstreams_missing_at_once_share_one_upstream_fetch_byte_exact(
    certs: Certs, carrier: str
) -> None:
    block = make_block(305, layers=5, size=LAYER)
    digest_extensions = [extensions for _, extensions in block.objects()]

    async def scenario() -> None:
        async with (
            relay_on(certs, carrier) as relay,
            publishing_on(relay, certs, carrier, block_track(block), block) as pub,
            session(relay, certs, carrier) as a,
            session(relay, certs, carrier) as b,
        ):
            pub.answer_fetches.clear()  # both FETCHes arrive while the miss is in flight
            first = asyncio.ensure_future(fetch_all(a, block.track, len(block.layers)))
            await until(lambda: pub.fetches == 1)
            second = asyncio.ensure_future(fetch_all(b, block.track, len(block.layers)))
            await until(lambda: relay.merged_fetches == 1)
            pub.answer_fetches.set()
            for objects in await asyncio.gather(first, second):
                assert [bytes(obj.payload) for obj in objects] == list(block.layers)
                assert [obj.extensions for obj in objects] == digest_extensions
            assert pub.fetches == 1
            assert_cached_exactly(relay, block, len(block.layers))

    run(scenario())
